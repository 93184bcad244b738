"""``deepinfer up`` (embedded cluster), ``deepinfer serve <service>`` and ``deepinfer generate --url``."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

from services.client import generate_stream
from services.launcher import Cluster, ClusterSpec
from shared import protocol
from shared.bus import connect

DEMO_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


async def stream_to_terminal(url: str, request: protocol.GenerateRequest) -> dict:
    nc = await connect(url, "deepinfer-cli")
    usage: dict = {}
    try:
        async for chunk in generate_stream(nc, request):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            usage = chunk.usage or usage
    finally:
        await nc.close()
    print()
    if usage:
        print(f"[{usage.get('completion_tokens')} tokens, prompt {usage.get('prompt_tokens')} "
              f"(cached {usage.get('cached_tokens')}), ttft {usage.get('ttft_ms', 0):.0f} ms, "
              f"tpot {usage.get('tpot_ms', 0):.0f} ms]", file=sys.stderr)
    return usage


async def _up(args: argparse.Namespace) -> int:
    spec = ClusterSpec(prefill=args.prefill, decode=args.decode, nats_url=args.nats or "", model=args.model or "",
                       kv_cache_mb=args.kv_cache_mb, local_prefill_threshold=args.local_prefill_threshold)
    cluster = Cluster(spec)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        print(f"starting: nats-server, router, {spec.prefill} prefill, {spec.decode} decode "
              f"(logs in {cluster.log_dir}) ...", flush=True)
        await cluster.start()
        print(f"deepinfer is up\n  NATS      {cluster.nats_url}\n  API       di.v1.generate (msgpack; see README)\n"
              f"  try       deepinfer generate --url {cluster.nats_url} --chat \"Hello\"", flush=True)
        if args.demo:
            print(f"\nuser> {DEMO_MESSAGES[0]['content']}\nassistant> ", end="", flush=True)
            await stream_to_terminal(cluster.nats_url, protocol.GenerateRequest(
                messages=DEMO_MESSAGES, max_tokens=64, temperature=0.0, timeout_s=120.0))
        if not args.exit_after_demo:
            print("serving; Ctrl-C stops everything", flush=True)
            await stop.wait()
    finally:
        await asyncio.to_thread(cluster.stop)
        print("stopped", flush=True)
    return 0


def run_up(args: argparse.Namespace) -> int:
    return asyncio.run(_up(args))


def run_remote_generate(args: argparse.Namespace) -> int:
    request = protocol.GenerateRequest(
        **({"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}),
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=list(args.stop))
    asyncio.run(stream_to_terminal(args.url, request))
    return 0


def run_serve(args: argparse.Namespace, extra: list[str]) -> int:
    import importlib

    module = importlib.import_module(f"services.{args.service}.__main__")
    with contextlib.suppress(KeyboardInterrupt):
        module.main(extra)
    return 0
