"""A burst through any OpenAI-compatible server, as a plain streaming client sends it: every prompt of the bench
set at once to ``/v1/completions`` as token ids, greedy, ``ignore_eos``, ``max_tokens`` each, no deadline of its
own (as vLLM's benchmark client). Side by side with the in-process engine on the same work, and with as many
``deepinfer up`` layouts as asked for, in one run.

Reported per prompt set and server: requests ok / errors, output tokens/s over the burst's wall time, TTFT and
TPOT p50/p99 (client-side: first streamed token; mean gap between later tokens), and the ratio of tokens/s to
the in-process engine's; for each launched layout, every process's user+system CPU seconds during the burst.

    python -m benchmarks.openai_burst --url http://127.0.0.1:8000          # a running server (vllm serve too)
    python -m benchmarks.openai_burst --engine --up "--prefill 0 --cache-tier 0" --up ""   # launches them here
    python -m benchmarks.openai_burst --engine --up "" --variant plain={} \
        --variant 'penalties={"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}'
``--variant NAME=JSON`` (repeatable) adds JSON's fields to every request body (the engine baseline gets the same
sampling fields, ``response_format`` / ``guided_*`` as its structured-output spec), each variant a burst of its
own on the same server, side by side (each under its own ``cache_salt``: no variant finds another's prompts
cached).
``--plot PNG`` draws each prompt set's TTFT and TPOT CDFs per server.
Prompt sets: ``distinct`` (the 64 bench prompts) and ``shared-prefix`` (the same behind one 1,002-token block).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import time

import aiohttp

from benchmarks import plots
from benchmarks.engine_throughput import load_prompt_set
from shared import progress

log = logging.getLogger("bench.burst")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def one(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int,
              api_key: str, extra: dict | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    times, tokens, error, pieces = [], 0, None, []
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                return {"error": f"HTTP {resp.status}: {(await resp.text())[:120]}", "tokens": 0}
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = str(event["error"].get("code") or event["error"])
                    break
                if any(c.get("text") for c in event.get("choices", [])):
                    times.append(time.perf_counter() - t0)
                    pieces.append("".join(c.get("text") or "" for c in event["choices"]))
                usage = event.get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens", 0))
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        error = repr(exc)
    if error is None and tokens < max_tokens and body.get("ignore_eos", True):
        error = f"stream ended after {tokens} of {max_tokens} tokens"   # a variant may let EOS end it
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    if error is None and (extra or {}).get("response_format", {}).get("type") in ("json_object", "json_schema"):
        try:
            json.loads("".join(pieces))
        except ValueError:
            error = "output is not JSON" if tokens < max_tokens else None   # cut by max_tokens: not an error
    return {"error": error, "tokens": tokens, "ttft": times[0] if times else None, "tpot": tpot}


async def burst(url: str, prompts: list[list[int]], max_tokens: int, api_key: str = "", model: str = "",
                extra: dict | None = None) -> dict:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=1800)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        if not model:
            async with session.get(url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"}
                                   if api_key else {}) as resp:
                model = (await resp.json())["data"][0]["id"]
        t0 = time.perf_counter()
        rows = await progress.gather((one(session, url, model, p, max_tokens, api_key, extra) for p in prompts),
                                     f"burst {url}")
        wall = time.perf_counter() - t0
    ok = [r for r in rows if r["error"] is None]
    errors = sorted({r["error"] for r in rows if r["error"]})
    return {"ok": len(ok), "errors": len(rows) - len(ok), "why": errors[:3], "wall": wall,
            "tok_s": sum(r["tokens"] for r in rows) / wall,
            "ttft": [r["ttft"] for r in ok if r["ttft"] is not None],
            "tpot": [r["tpot"] for r in ok if r["tpot"] is not None]}


def engine_burst(prompts: list[list[int]], max_tokens: int, extra: dict | None = None,
                 dtype: str = "float32") -> dict:
    """The in-process engine on the same work (every prompt added at once, stepped to the end), with a variant's
    sampling fields."""
    from shared.engine.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.sampling import SamplingParams

    from services.router.openai_api import structured_spec

    engine = LLMEngine.from_path(None, EngineConfig(dtype=dtype, device="cpu"))
    fields = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **(extra or {})}
    spec = structured_spec(fields)      # the HTTP body's response_format / guided_* as the engine's spec
    fields = {k: v for k, v in fields.items() if k not in ("response_format", "structured_outputs")
              and not k.startswith("guided_")}
    params = SamplingParams(**fields, structured=spec)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    first, last, counts, tokens = {}, {}, {}, 0
    with progress.bar(len(prompts), "in-process engine", "req") as done:
        while engine.has_unfinished():
            for out in engine.step():
                now = time.perf_counter() - t0
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                counts[out.request_id] = out.num_output_tokens
                done.update(int(out.finished))
            tokens = sum(counts.values())
    wall = time.perf_counter() - t0
    tpot = [(last[r] - first[r]) / (counts[r] - 1) for r in first if counts[r] > 1]
    return {"ok": len(first), "errors": 0, "why": [], "wall": wall, "tok_s": tokens / wall,
            "ttft": list(first.values()), "tpot": tpot}


def cpu_seconds(pids: dict[str, int]) -> dict[str, tuple[float, float]]:
    """(user, system) CPU seconds each process has used so far (Linux /proc; a missing process is left out)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) / tick, int(fields[12]) / tick)    # utime, stime
    return out


async def up_burst(flags: str, prompts: list[list[int]], max_tokens: int,
                   variants: dict[str, dict] | None = None) -> dict[str, dict]:
    """Start ``deepinfer up <flags>`` (its defaults otherwise), warm it with one request, run one burst per
    variant, stop. ``cpu``: each process's (user, system) CPU seconds during a burst (the served path's
    breakdown)."""
    from cli import up as cli_up
    from cli.main import build_parser
    from cli.launcher import Cluster

    args = build_parser().parse_args(["up", "--http-port", "0", "--cache-tier-dir", "", *shlex.split(flags)])
    spec = cli_up.spec_from_args(args, log.info)
    cluster = Cluster(spec)
    try:
        await cluster.start()
        await burst(cluster.http_url, prompts[:1], 4, cli_up.first_key(spec.api_keys))
        pids = {name: proc.pid for name, proc in cluster.procs.items()}
        if cluster.server is not None:
            pids["nats-server"] = cluster.server.proc.pid
        results = {}
        for name, extra in (variants or {"": {}}).items():
            before = cpu_seconds(pids)
            salted = {**extra, "cache_salt": f"variant-{name}"}   # no variant finds another's prompts cached
            result = await burst(cluster.http_url, prompts, max_tokens, cli_up.first_key(spec.api_keys), extra=salted)
            after = cpu_seconds(pids)
            result["cpu"] = {n: (after[n][0] - before[n][0], after[n][1] - before[n][1])
                             for n in after if n in before}
            results[name] = result
        return results
    finally:
        await asyncio.to_thread(cluster.stop)


def show(name: str, r: dict, base: float | None) -> str:
    ratio = f"{r['tok_s'] / base:6.2f}x" if base else "      -"
    return (f"{name:<34}{r['ok']:>4}/{r['errors']:<4}{r['tok_s']:9.1f}{ratio}{pct(r['ttft'], .5):9.2f}"
            f"{pct(r['ttft'], .99):8.2f}{pct(r['tpot'], .5) * 1e3:9.1f}{pct(r['tpot'], .99) * 1e3:8.1f}"
            + (f"   {r['why']}" if r["why"] else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", action="append", default=[], help="a running OpenAI-compatible server (repeatable)")
    ap.add_argument("--up", action="append", default=[], metavar="FLAGS",
                    help="launch `deepinfer up FLAGS` here and burst it (repeatable; '' = the defaults)")
    ap.add_argument("--engine", action="store_true", help="also run the in-process engine (the baseline)")
    ap.add_argument("--engine-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the in-process engine's dtype (compare with `--up \"--dtype bfloat16\"`)")
    ap.add_argument("--prompt-set", default="both", choices=["distinct", "shared-prefix", "both"])
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--api-key", default="")
    ap.add_argument("--model", default="", help="model id (default: the first of /v1/models)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="extra request fields, e.g. 'penalties={\"presence_penalty\": 1.5}' (repeatable)")
    ap.add_argument("--plot", default="", metavar="PNG",
                    help="also draw each prompt set's TTFT and TPOT CDFs per server here (needs matplotlib)")
    args = ap.parse_args()
    variants = {v.partition("=")[0]: json.loads(v.partition("=")[2] or "{}") for v in args.variant} or {"": {}}
    tag = lambda label, name: f"{label} [{name}]" if name else label   # noqa: E731
    logging.basicConfig(level=logging.WARNING)
    sets = ["distinct", "shared-prefix"] if args.prompt_set == "both" else [args.prompt_set]
    by_set: dict[str, dict[str, dict]] = {}
    for name in sets:
        prompts = load_prompt_set(name, args.limit)
        results: dict[str, dict] = {}
        for variant, extra in variants.items():
            if args.engine:
                results[tag("in-process engine", variant)] = engine_burst(prompts, args.max_tokens, extra, args.engine_dtype)
        for flags in args.up:
            for variant, r in asyncio.run(up_burst(flags, prompts, args.max_tokens, variants)).items():
                results[tag(f"deepinfer up {flags}".strip(), variant)] = r
        for url in args.url:
            for variant, extra in variants.items():
                results[tag(url, variant)] = asyncio.run(burst(url, prompts, args.max_tokens, args.api_key,
                                                               args.model, extra))
        base = results.get(tag("in-process engine", next(iter(variants))), {}).get("tok_s")
        print(f"\n{name}: {len(prompts)} prompts x {args.max_tokens} tokens, all at once, greedy, ignore_eos")
        hdr = f"{'server':<34}{'ok/err':>9}{'tok/s':>9}{'vs eng':>7}{'TTFT p50':>9}{'p99':>8}{'TPOT ms':>9}{'p99':>8}"
        print(hdr)
        print("-" * len(hdr))
        for label, r in results.items():
            print(show(label, r, base))
        for label, r in results.items():
            if r.get("cpu"):
                print(f"CPU during the burst ({r['wall']:.1f} s wall, {os.cpu_count()} cores), {label}: "
                      + ", ".join(f"{n} {u:.1f}+{s:.1f} s" for n, (u, s) in sorted(r["cpu"].items())))
        by_set[name] = results
    if args.plot:
        plots.plot_or_exit(lambda: draw(by_set, args.plot, args.max_tokens))


def draw(by_set: dict[str, dict[str, dict]], path: str, max_tokens: int) -> None:
    """Per prompt set, TTFT and TPOT CDFs of every server's burst."""
    plt, fig, axes = plots.panels(2 * len(by_set), f"64-request burst, {max_tokens} tokens each, greedy")
    for k, (name, results) in enumerate(by_set.items()):
        plots.cdf(axes[2 * k], {label: r["ttft"] for label, r in results.items()}, f"{name}: TTFT (s)")
        plots.cdf(axes[2 * k + 1], {label: [t * 1e3 for t in r["tpot"]] for label, r in results.items()},
                  f"{name}: TPOT per request (ms)")
    plots.save(plt, fig, path)


if __name__ == "__main__":
    main()
