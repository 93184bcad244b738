"""``deepinfer up``: an embedded cluster (nats-server with per-role users, router with the OpenAI HTTP API,
cache tier, prefill and decode workers, optional draft services) in the foreground; Ctrl-C stops everything.
Prints the HTTP and NATS endpoints and credentials; ``--demo`` streams one chat answer through the HTTP API."""
from __future__ import annotations

import argparse
from collections.abc import Callable
import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp

from shared import nats_auth
from shared.http_client import stream_events
from cli.flags import add_cluster_flags, add_nats_url, cluster_flag_values
from cli.launcher import Cluster, ClusterSpec
from cli.launcher_clients import ClientDesk
from cli.launcher_scale import LauncherScaleDesk

DEMO_PROMPT = "What is the capital of France? Answer in one sentence."  # the in-process demo asks the same
DEMO_MESSAGES = [{"role": "user", "content": DEMO_PROMPT}]


def add_parser(sub) -> None:
    up = sub.add_parser("up", help="start an embedded cluster: nats-server, router, prefill and decode workers")
    up.add_argument("--prefill", type=int, default=None,
                    help="prefill workers (default: 0 = aggregated decode workers on a host with fewer than 2 "
                         "GPUs, where splitting the cores measured slower; else 1)")
    up.add_argument("--decode", type=int, default=1)
    add_nats_url(up, "use this NATS server instead of starting one")
    up.add_argument("--cache-tier", type=int, default=1, metavar="N",
                    help="cache tier services (DRAM + SSD KV store; 0 = none); workers use them round robin")
    add_cluster_flags(up)
    up.add_argument("--api-keys", default=os.environ.get("DEEPINFER_API_KEYS", ""), metavar="KEY=TENANT,...|@FILE",
                    help="HTTP calls need one of these keys; its tenant salts the cache (default: no keys)")
    up.add_argument("--no-auth", action="store_true",
                    help="start nats-server without users (default: one user per role, fresh passwords)")
    up.add_argument("--passwords-file", default="", metavar="FILE",
                    help="with --nats-url: that server's NATS_PASSWORD_<USER>=... lines "
                         "(python -m shared.nats_auth env); --nats-url needs this or --no-auth")
    up.add_argument("--tenants", default="", metavar="A,B",
                    help="tenant client users client-<tenant> (each publishes only di.v1.generate.<tenant>)")
    up.add_argument("--switchable", action="store_true",
                    help="prefill and decode workers can switch role without reloading (worker-<n>; the planner's)")
    up.add_argument("--planner", action="store_true",
                    help="the router's online P:D planner: moves switchable workers between prefill and decode")
    up.add_argument("--planner-max-prefill", type=int, default=0, metavar="N",
                    help="with --planner: start prefill workers up to N when no worker can switch (0 = never)")
    up.add_argument("--planner-max-decode", type=int, default=0, metavar="N", help="the same for decode workers")
    up.add_argument("--demo", action="store_true", help="send one demo chat request through the HTTP API once up")
    up.add_argument("--exit-after-demo", action="store_true")


def draft_spec(args: argparse.Namespace, emit: Callable[..., None]) -> str:
    """``ClusterSpec.draft`` from the flags ("" | "local" | "<N>" services); ``ValueError`` for a bad value."""
    value = args.draft.strip()
    if value in ("", "local"):
        return value
    if value == "remote":
        return str(max(0, args.draft_services)) if args.draft_services else ""
    if value.isdigit():
        emit(f"deepinfer: note: --draft {value} is deprecated; say --draft remote --draft-services {value}",
             file=sys.stderr)
        return value if int(value) else ""
    raise ValueError(f"--draft must be local or remote, got {value!r}")


def default_prefill_workers() -> int:
    """``up``'s default layout on one host. Disaggregation pays when prefill and decode each get hardware of
    their own: on a CPU host they would split its cores, and one aggregated worker with every core served the
    bench burst at 0.9x the in-process engine where a 1+1 split reached 0.5x (2 cores: README, Threads).
    So: aggregated (0 prefill workers; the decode worker prefills) unless there are at least 2 GPUs."""
    import torch

    return 1 if torch.cuda.device_count() >= 2 else 0


def spec_from_args(args: argparse.Namespace, emit: Callable[..., None] = print) -> ClusterSpec:
    """The ``ClusterSpec`` of ``deepinfer up``'s flags; ``ValueError`` for a bad combination (e.g. --tenants
    without auth). Auth: the embedded server only (a --nats-url server's users are not ours to make)."""
    if args.nats_url and not args.no_auth and not args.passwords_file:
        raise ValueError("--nats-url needs that server's passwords (--passwords-file FILE, the NATS_PASSWORD_<USER>=..."
                         " lines its users were made from) or an explicit --no-auth")
    passwords = nats_auth.read_passwords(Path(args.passwords_file).read_text()) if args.passwords_file else {}
    if passwords and nats_auth.MONITOR not in passwords:
        raise ValueError("the passwords file has no monitor password (python -m shared.nats_auth env --monitor)")
    if passwords and args.planner and max(args.planner_max_prefill, args.planner_max_decode) > 0 \
            and nats_auth.LAUNCHER not in passwords:
        raise ValueError("--planner-max-* takes the planner's scale requests as the launcher user: the passwords "
                         "file has none (python -m shared.nats_auth env --monitor --launcher)")
    prefill = args.prefill if args.prefill is not None else default_prefill_workers()
    return ClusterSpec(prefill=prefill, decode=args.decode, nats_url=args.nats_url or "", model=args.model or "",
                       **cluster_flag_values(args), draft=draft_spec(args, emit), http_host=args.http_host,
                       http_port=args.http_port, api_keys=args.api_keys, auth=not args.no_auth, passwords=passwords,
                       tenants=[t.strip() for t in args.tenants.split(",") if t.strip()],
                       switchable=args.switchable, planner=args.planner,
                       planner_max_prefill=args.planner_max_prefill, planner_max_decode=args.planner_max_decode)


def run(args: argparse.Namespace, emit: Callable[..., None] = print) -> int:
    """``deepinfer up``; everything shown goes through ``emit`` (``print``'s signature)."""
    try:
        spec = spec_from_args(args, emit)
    except (ValueError, OSError) as err:
        emit(f"deepinfer: error: {err}", file=sys.stderr)
        return 2
    if args.demo and spec.http_port < 0:
        emit("deepinfer: error: --demo goes through the HTTP API: drop --http-port -1", file=sys.stderr)
        return 2
    return asyncio.run(serve(args, spec, emit))


async def serve(args: argparse.Namespace, spec: ClusterSpec, emit: Callable[..., None]) -> int:
    """Start ``spec``'s services (``up``: a whole cluster; ``node``: one host's part), show the banner, run the
    demo when asked, serve until SIGINT/SIGTERM, stop everything."""
    cluster = Cluster(spec)
    stop = asyncio.Event()
    desk: LauncherScaleDesk | None = None  # the planner's scale requests (--planner --planner-max-*)
    clients: ClientDesk | None = None  # the operator's tenant clients (with auth)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        emit(f"starting: nats-server, {'router, ' if spec.router else ''}{spec.cache_tier} cache tier, "
             f"{spec.prefill} prefill, {spec.decode} decode "
              f"(logs in {cluster.log_dir}) ...", flush=True)
        await cluster.start()
        if cluster.scales:
            desk = LauncherScaleDesk(cluster, {"prefill": spec.planner_max_prefill, "decode": spec.planner_max_decode})
            await desk.start()
        if cluster.admits_clients:
            clients = ClientDesk(cluster)
            await clients.start()
        emit(banner(cluster), flush=True)
        if args.demo:
            emit(f"\nuser> {DEMO_MESSAGES[0]['content']}\nassistant> ", end="", flush=True)
            await http_demo(cluster.http_url, first_key(spec.api_keys), emit)
        if not args.exit_after_demo:
            emit("serving; Ctrl-C stops everything", flush=True)
            await stop.wait()
    finally:
        if desk is not None:
            await desk.close()
        if clients is not None:
            await clients.close()
        await asyncio.to_thread(cluster.stop)
        emit("stopped", flush=True)
    return 0


def banner(cluster: Cluster) -> str:
    lines = ["deepinfer is up"]
    if cluster.http_url:
        lines += [f"  HTTP      {cluster.http_url}/v1   (OpenAI-compatible; /health, /metrics)",
                  f"  try       curl {cluster.http_url}/v1/chat/completions -H 'Content-Type: application/json' "
                  "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 32}'"]
    lines += [f"  NATS      {cluster.nats_url}   (di.v1.generate, msgpack; see README)"]
    if cluster.passwords:
        user, password = cluster.client_credentials
        lines += [f"  client    user {user}, password {password}  ({cluster.client_url()})"]
        lines += [f"  tenant    {t}: {cluster.client_url(tenant=t)}  (publishes di.v1.generate.{t})"
                  for t in cluster.spec.tenants]
        lines += [f"  status    deepinfer status --nats-url {cluster.client_url(user='monitor')}"]
        if cluster.admits_clients:
            lines += [f"  clients   deepinfer client add <tenant> --nats-url {cluster.client_url(user='admin')}"]
    lines += [f"  metrics   {name}: http://127.0.0.1:{port}/metrics" for name, port in cluster.metrics_ports.items()]
    lines += [f"  try       deepinfer generate --nats-url {cluster.client_url()} --chat \"Hello\""]
    return "\n".join(lines)


def first_key(spec: str) -> str:
    """The first API key of a ``--api-keys`` spec ("" when none), for the demo request."""
    from services.router.api_keys import parse_api_keys

    return next(iter(parse_api_keys(spec)), "")


async def http_demo(base_url: str, api_key: str = "", emit: Callable[..., None] = print) -> dict:
    """Stream one greedy chat answer through the OpenAI-compatible API to stdout; returns its usage. An error
    raises ``DeepinferError`` (``deepinfer`` exits 2 with it)."""
    body = {"messages": DEMO_MESSAGES, "max_tokens": 64, "temperature": 0, "timeout_s": 120,
            "stream_options": {"include_usage": True}}
    usage: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        async for event in stream_events(session, base_url + "/v1/chat/completions", body, api_key):
            for choice in event["choices"]:
                emit(choice["delta"].get("content") or "", end="", flush=True)
            usage = event.get("usage") or usage
    emit()
    if usage:
        emit(f"[{usage['completion_tokens']} tokens, prompt {usage['prompt_tokens']} "
              f"(cached {usage['prompt_tokens_details']['cached_tokens']}) via {base_url}/v1]", file=sys.stderr)
    return usage
