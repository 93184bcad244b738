"""The ``deepinfer`` command: the only module allowed to print (everything else logs; subcommands that live
elsewhere, ``up`` in ``cli/up.py`` among them, get ``print`` passed in).

Subcommands: ``generate`` (in-process engine, or ``--url`` a running cluster), ``demo`` (in-process, one chat
request), ``up`` (embedded cluster: nats-server, router, cache tier, prefill and decode workers), ``serve
<service>``, ``status`` (a running cluster's services, hit rates and accounting), ``simulate``, ``bench``.

NATS credentials: ``up`` starts its server with authentication (``--no-auth`` to disable; with a ``--nats`` server,
``--passwords-file`` names its users' passwords, or ``--no-auth`` says there are none) and prints the client's
URL with its credentials; ``generate --url`` and ``status`` take
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
import sys
import time
import urllib.parse


from cli import node as cli_node, up as cli_up
from cli.flags import add_nats_url, check_required
from cli.up import DEMO_PROMPT
from shared.client import generate_stream
from shared import nats_auth, protocol
from shared.bus import connect
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.errors import DeepinferError
from shared import progress as progress_bars



def load_engine(args: argparse.Namespace) -> LLMEngine:
    bar = progress_bars.bar(0, "loading model", "tensor")

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


def run_remote_generate(args: argparse.Namespace) -> int:
    request = protocol.GenerateRequest(
        **({"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}),
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=list(args.stop))
    asyncio.run(stream_to_terminal(args.nats_url, request, args.user, args.password))
    return 0


async def _status(args: argparse.Namespace) -> int:
    from cli import status

    nc = await connect(args.nats_url, "deepinfer-status", user=args.user, password=args.password)
    try:
        if args.watch:   # a live terminal view until Ctrl-C
            from cli import status_watch
            with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
                await status_watch.watch(nc, interval_s=args.interval, listen_s=args.listen)
            return 0
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
    add_nats_url(gen, "send to a running cluster instead of the in-process engine")
    _add_credential_args(gen)
    _add_engine_args(gen)
    _add_sampling_args(gen)

    demo = sub.add_parser("demo", help="load the default model and answer one chat request in-process")
    _add_engine_args(demo)

    cli_up.add_parser(sub)
    cli_node.add_parser(sub)

    from cli import bench as trace_bench, simulate as simulate_cmd

    simulate_cmd.add_parser(sub)
    trace_bench.add_parser(sub)

    st = sub.add_parser("status", help="workers, cache tiers, hit rates and accounting of a running cluster")
    add_nats_url(st, "the cluster's NATS server", required=True)
    st.add_argument("--listen", type=float, default=1.5, help="seconds to listen for heartbeats")
    st.add_argument("--json", action="store_true", help="print the raw report as JSON")
    st.add_argument("--watch", action="store_true", help="a live view in the terminal, redrawn every --interval")
    st.add_argument("--interval", type=float, default=2.0, help="seconds between --watch frames")
    _add_credential_args(st)

    cl = sub.add_parser("client", help="add, remove or list a running cluster's tenant clients (NATS users)")
    cl.add_argument("op", choices=["add", "remove", "list"])
    cl.add_argument("tenant", nargs="?", default="", help="the tenant (add, remove)")
    add_nats_url(cl, "the cluster's NATS server, as its admin user (deepinfer up prints it)", required=True)
    _add_credential_args(cl)

    serve = sub.add_parser("serve", help="run one service in the foreground (flags after it go to the service)")
    serve.add_argument("service", choices=["router", "prefill", "decode", "cache-tier", "draft"])

    spec = sub.add_parser("spec", help="speculative decoding tools")
    spec_sub = spec.add_subparsers(dest="spec_command", required=True)
    from shared.spec import train_head

    train_head.add_parser(spec_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    check_required(parser, args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return run_remote_generate(args) if args.nats_url else run_generate(args)
        if args.command == "up":
            return cli_up.run(args, print)
        if args.command == "node":
            return cli_node.run(args, print)
        if args.command == "serve":
            return run_serve(args, extra)
        if args.command == "status":
            return asyncio.run(_status(args))
        if args.command == "client":
            from cli import launcher_clients

            if args.op != "list" and not args.tenant:
                parser.error(f"client {args.op} needs a tenant")
            return asyncio.run(launcher_clients.run_cli(args, print))
        if args.command == "spec":
            from shared.spec import train_head

            return train_head.run(args, print)
        if args.command in ("simulate", "bench"):
            from cli import bench as trace_bench, simulate as simulate_cmd

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
