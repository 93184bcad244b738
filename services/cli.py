"""The ``deepinfer`` command: the only module allowed to print (everything else logs).

Subcommands: ``generate`` (in-process engine, or ``--url`` a running cluster), ``demo`` (in-process, one chat
request), ``up`` (embedded cluster: nats-server, router, cache tier, prefill and decode workers), ``serve
<service>``, ``status`` (a running cluster's services, hit rates and accounting), ``simulate``, ``bench``.

NATS credentials: ``up`` starts its server with authentication (``--no-auth`` to disable; a ``--nats`` server is
never touched) and prints the client's URL with its credentials; ``generate --url`` and ``status`` take
``--user``/``--password`` (default: ``DEEPINFER_NATS_USER``/``DEEPINFER_NATS_PASSWORD``) or credentials in the
URL (``nats://user:pass@host:port``).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import logging
import signal
import sys
import time
import urllib.parse

from tqdm import tqdm

from shared.client import generate_stream
from shared.launcher import Cluster, ClusterSpec
from shared import nats_auth, protocol
from shared.bus import connect
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.errors import DeepinferError

DEMO_PROMPT = "What is the capital of France? Answer in one sentence."


def load_engine(args: argparse.Namespace) -> LLMEngine:
    bar = tqdm(total=0, desc="loading model", unit="tensor", file=sys.stderr, leave=False,
                disable=not sys.stderr.isatty())

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        config = EngineConfig(dtype=args.dtype, device=args.device, num_threads=args.threads)
        return LLMEngine.from_path(args.model, config, progress=progress)
    finally:
        bar.close()


def stream(engine: LLMEngine, prompt: str, chat: bool, params: SamplingParams) -> None:
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    request_id = engine.add_request(tok.encode(text), params)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            if out.finished:
                elapsed = time.perf_counter() - t0
                print(f"\n[{out.num_output_tokens} tokens, finish={out.finish_reason}, "
                      f"ttft={out.ttft * 1000:.0f} ms, {out.num_output_tokens / elapsed:.1f} tok/s]",
                      file=sys.stderr)


def run_generate(args: argparse.Namespace) -> int:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))
    engine = load_engine(args)
    stream(engine, args.prompt, args.chat, params)
    return 0


def run_demo(args: argparse.Namespace) -> int:
    engine = load_engine(args)
    print(f"user> {DEMO_PROMPT}\nassistant> ", end="", flush=True)
    stream(engine, DEMO_PROMPT, True, SamplingParams(max_tokens=64, temperature=0.0))
    return 0


DEMO_MESSAGES = [{"role": "user", "content": DEMO_PROMPT}]


async def stream_to_terminal(url: str, request: protocol.GenerateRequest, user: str = "", password: str = "") -> dict:
    """Stream one request's text to stdout; a tenant's user (``client-<tenant>``) sends on its tenant subject."""
    nc = await connect(url, "deepinfer-cli", user=user, password=password)
    tenant = nats_auth.tenant_of_user(user or urllib.parse.unquote(urllib.parse.urlsplit(url).username or ""))
    usage: dict = {}
    try:
        async for chunk in generate_stream(nc, request, tenant=tenant):
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


async def _up(args: argparse.Namespace, spec: ClusterSpec) -> int:
    cluster = Cluster(spec)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        print(f"starting: nats-server, router, {spec.cache_tier} cache tier, {spec.prefill} prefill, {spec.decode} decode "
              f"(logs in {cluster.log_dir}) ...", flush=True)
        await cluster.start()
        print(f"deepinfer is up\n  NATS      {cluster.nats_url}\n  API       di.v1.generate (msgpack; see README)\n"
              + _credential_lines(cluster)
              + f"  try       deepinfer generate --url {cluster.client_url()} --chat \"Hello\"", flush=True)
        if args.demo:
            print(f"\nuser> {DEMO_MESSAGES[0]['content']}\nassistant> ", end="", flush=True)
            user, password = cluster.client_credentials
            await stream_to_terminal(cluster.nats_url, protocol.GenerateRequest(
                messages=DEMO_MESSAGES, max_tokens=64, temperature=0.0, timeout_s=120.0), user, password)
        if not args.exit_after_demo:
            print("serving; Ctrl-C stops everything", flush=True)
            await stop.wait()
    finally:
        await asyncio.to_thread(cluster.stop)
        print("stopped", flush=True)
    return 0


def _credential_lines(cluster: Cluster) -> str:
    """The ``up`` banner's credential lines ("" without auth): passwords are fresh per run."""
    if not cluster.passwords:
        return ""
    user, password = cluster.client_credentials
    lines = [f"  client    user {user}, password {password}  ({cluster.client_url()})"]
    lines += [f"  tenant    {t}: {cluster.client_url(tenant=t)}  (publishes di.v1.generate.{t})"
              for t in cluster.spec.tenants]
    lines.append(f"  status    deepinfer status --url {cluster.client_url(user='monitor')}")
    return "\n".join(lines) + "\n"


def run_up(args: argparse.Namespace) -> int:
    try:  # auth: the embedded server only (a --nats server's users are not ours to make)
        spec = ClusterSpec(prefill=args.prefill, decode=args.decode, nats_url=args.nats or "", model=args.model or "",
                           kv_cache_mb=args.kv_cache_mb, local_prefill_threshold=args.local_prefill_threshold,
                           policy=args.policy, ttft_slo_s=args.ttft_slo, cache_tier=args.cache_tier,
                           cache_tier_dir=args.cache_tier_dir, draft=args.draft, drafter=args.drafter,
                           auth=not args.no_auth and not args.nats,
                           tenants=[t.strip() for t in args.tenants.split(",") if t.strip()])
    except ValueError as err:  # e.g. --tenants without auth, or a tenant name that cannot be a NATS user
        print(f"deepinfer: error: {err}", file=sys.stderr)
        return 2
    return asyncio.run(_up(args, spec))


def run_remote_generate(args: argparse.Namespace) -> int:
    request = protocol.GenerateRequest(
        **({"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}),
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=list(args.stop))
    asyncio.run(stream_to_terminal(args.url, request, args.user, args.password))
    return 0


async def _status(args: argparse.Namespace) -> int:
    from shared import status

    nc = await connect(args.url, "deepinfer-status", user=args.user, password=args.password)
    try:
        report = await status.collect(nc, listen_s=args.listen)
    finally:
        await nc.close()
    print(json.dumps(report, sort_keys=True) if args.json else status.format_status(report))
    return 0 if report["services"] else 1


def run_serve(args: argparse.Namespace, extra: list[str]) -> int:
    module = importlib.import_module(f"services.{args.service.replace('-', '_')}.__main__")
    with contextlib.suppress(KeyboardInterrupt):
        module.main(extra)
    return 0


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16 | float64")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: CPUs available)")


def _add_credential_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--user", default=os.environ.get("DEEPINFER_NATS_USER", ""),
                   help="NATS user (default $DEEPINFER_NATS_USER; or put user:pass@ in the URL)")
    p.add_argument("--password", default=os.environ.get("DEEPINFER_NATS_PASSWORD", ""),
                   help="NATS password (default $DEEPINFER_NATS_PASSWORD)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="deepinfer: LLM inference serving")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt (in-process engine)")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--url", default=None, help="send to a running cluster (nats://...) instead of in-process")
    _add_credential_args(gen)
    _add_engine_args(gen)
    _add_sampling_args(gen)

    demo = sub.add_parser("demo", help="load the default model and answer one chat request in-process")
    _add_engine_args(demo)

    up = sub.add_parser("up", help="start an embedded cluster: nats-server, router, prefill and decode workers")
    up.add_argument("--prefill", type=int, default=1)
    up.add_argument("--decode", type=int, default=1)
    up.add_argument("--nats", default=None, help="use this NATS server instead of starting one")
    up.add_argument("--model", default=None)
    up.add_argument("--kv-cache-mb", type=int, default=256)
    up.add_argument("--local-prefill-threshold", type=int, default=64)
    up.add_argument("--policy", default="predictive",
                    help="placement: round_robin | least_loaded | cache_aware | kv_cost | predictive")
    up.add_argument("--ttft-slo", type=float, default=0.0, metavar="S",
                    help="admission control: reject (overloaded) requests whose predicted TTFT exceeds S seconds")
    up.add_argument("--cache-tier", type=int, default=1, metavar="N",
                    help="cache tier services (DRAM + SSD KV store; 0 = none); workers use them round robin")
    up.add_argument("--cache-tier-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "deepinfer", "cache-tier"),
                    help="where the tiers keep their SSD files (default ~/.cache/deepinfer/cache-tier; kept across runs)")
    up.add_argument("--draft", default="", metavar="N|local",
                    help="speculative decoding: N draft services, or 'local' (a drafter inside each decode worker)")
    up.add_argument("--drafter", default="prompt_lookup",
                    help="prompt_lookup | self:<layers> (the model's first layers) | a smaller model's path")
    up.add_argument("--no-auth", action="store_true",
                    help="start nats-server without users (default: one user per role, fresh passwords)")
    up.add_argument("--tenants", default="", metavar="A,B",
                    help="tenant client users client-<tenant> (each publishes only di.v1.generate.<tenant>)")
    up.add_argument("--demo", action="store_true", help="send one demo chat request once up")
    up.add_argument("--exit-after-demo", action="store_true")

    from benchmarks import simulate_cmd, trace_bench

    simulate_cmd.add_parser(sub)
    trace_bench.add_parser(sub)

    st = sub.add_parser("status", help="workers, cache tiers, hit rates and accounting of a running cluster")
    st.add_argument("--url", required=True, help="the cluster's NATS URL (nats://...)")
    st.add_argument("--listen", type=float, default=1.5, help="seconds to listen for heartbeats")
    st.add_argument("--json", action="store_true", help="print the raw report as JSON")
    _add_credential_args(st)

    serve = sub.add_parser("serve", help="run one service in the foreground (flags after it go to the service)")
    serve.add_argument("service", choices=["router", "prefill", "decode", "cache-tier", "draft"])

    spec = sub.add_parser("spec", help="speculative decoding tools")
    spec_sub = spec.add_subparsers(dest="spec_command", required=True)
    from shared.spec import train_head

    train_head.add_parser(spec_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra and args.command != "serve":
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return run_remote_generate(args) if args.url else run_generate(args)
        if args.command == "up":
            return run_up(args)
        if args.command == "serve":
            return run_serve(args, extra)
        if args.command == "status":
            return asyncio.run(_status(args))
        if args.command == "spec":
            from shared.spec import train_head

            return train_head.run(args, print)
        if args.command in ("simulate", "bench"):
            from benchmarks import simulate_cmd, trace_bench

            return (simulate_cmd if args.command == "simulate" else trace_bench).run(args, print)
        if args.command == "demo":
            return run_demo(args)
    except DeepinferError as err:
        print(f"deepinfer: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
