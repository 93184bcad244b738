"""1,000 streaming HTTP clients that stop reading, against one router (``max_inflight`` 256): are the others
still served? (issue 21's figure; SmolLM2-135M fp32, ``deepinfer up`` defaults: one aggregated decode worker.)

Two API keys, two tenants. ``calm`` first sends ``--calm`` streamed requests one after another on the idle
cluster (its unloaded TTFT). Then ``stall`` opens ``--stalled`` connections, each a streamed
``/v1/completions`` call of ``--stall-tokens`` tokens with a 4 KiB receive buffer, reads the status line and
never another byte; while they hang, ``calm`` sends ``--calm`` requests again, one every ``--calm-every`` s.
Prints: stalled calls admitted (200) and refused (429), calm TTFT p50/p99 unloaded vs during the stall, calm
errors, and how long until the router's in-flight count fell back (stalled streams cut off).

    python -m benchmarks.stalled_clients [--stalled 1000] [--stall-tokens 512] [--calm 8]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import socket
import time

import aiohttp

from benchmarks.e2e_services import pct
from benchmarks.engine_throughput import load_prompt_set
from cli.launcher import Cluster, ClusterSpec

KEYS = "key-stall=stall,key-calm=calm"


async def calm_ttft(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int]) -> float | None:
    """Seconds to the first streamed token of one ``calm`` request (None: it failed)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body,
                            headers={"Authorization": "Bearer key-calm"}) as resp:
        if resp.status != 200:
            return None
        async for line in resp.content:
            if line.startswith(b"data: {") and json.loads(line[6:]).get("choices"):
                return time.perf_counter() - t0
    return None


async def stalled(port: int, model: str, prompt: list[int], tokens: int, held: list) -> int:
    """Open one streamed call, read its status line, then hold the connection (appended to ``held``) without
    reading another byte; returns its HTTP status."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)      # before connect: a small window
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True,
                       "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer key-stall\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    status = int((await asyncio.wait_for(reader.readline(), 120)).split()[1])
    held.append(writer)                                               # held open, never read again
    return status


async def in_flight(session: aiohttp.ClientSession, metrics_url: str) -> float:
    async with session.get(metrics_url, headers={"Authorization": "Bearer key-calm"}) as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith("deepinfer_router_inflight "):
                return float(line.split()[-1])
    return float("nan")


async def run(args) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.stalled + 256)), hard))
    prompts = load_prompt_set("distinct", 64)
    held: list = []
    cluster = Cluster(ClusterSpec(prefill=0, decode=1, kv_cache_mb=1024, api_keys=KEYS, cache_tier=0))
    try:
        await cluster.start()
        url, port = cluster.http_url, cluster.http_port
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            async with session.get(url + "/v1/models", headers={"Authorization": "Bearer key-calm"}) as resp:
                model = (await resp.json())["data"][0]["id"]
            idle = [await calm_ttft(session, url, model, prompts[i]) for i in range(args.calm)]
            t0 = time.perf_counter()
            statuses = await asyncio.gather(*(stalled(port, model, prompts[i % 64], args.stall_tokens, held)
                                              for i in range(args.stalled)), return_exceptions=True)
            opened = time.perf_counter() - t0
            loaded = []
            for i in range(args.calm):
                loaded.append(await calm_ttft(session, url, model, prompts[(i + 7) % 64]))
                await asyncio.sleep(args.calm_every)
            ok = sum(1 for s in statuses if s == 200)
            refused = sum(1 for s in statuses if s == 429)
            failed = len(statuses) - ok - refused
            t_wait, drained_after = time.perf_counter(), None
            while time.perf_counter() - t_wait < 120:
                if await in_flight(session, url + "/metrics") == 0:
                    drained_after = time.perf_counter() - t0
                    break
                await asyncio.sleep(1)
        for writer in held:
            writer.close()
    finally:
        await asyncio.to_thread(cluster.stop)
    good_idle = [t for t in idle if t is not None]
    good_loaded = [t for t in loaded if t is not None]
    print(f"\n{args.stalled} stalled streaming calls (opened in {opened:.1f} s): {ok} admitted, {refused} refused "
          f"(429), {failed} failed to connect")
    print(f"calm tenant TTFT p50 / p99: unloaded {pct(good_idle, .5) * 1e3:.0f} / {pct(good_idle, .99) * 1e3:.0f} ms,"
          f" during the stall {pct(good_loaded, .5) * 1e3:.0f} / {pct(good_loaded, .99) * 1e3:.0f} ms; calm errors "
          f"{len(loaded) - len(good_loaded)} of {len(loaded)}")
    if drained_after is not None:
        print(f"router in-flight back to 0 after {drained_after:.0f} s (stalled streams cut off)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stalled", type=int, default=1000)
    ap.add_argument("--stall-tokens", type=int, default=512)
    ap.add_argument("--calm", type=int, default=8)
    ap.add_argument("--calm-every", type=float, default=1.0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
