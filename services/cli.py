"""The ``deepinfer`` command.

Subcommands: ``generate`` (in-process engine, streams text), ``demo`` (what ``make run`` shows).
The CLI is the only place allowed to print: everything else logs.
"""
from __future__ import annotations

import argparse
import logging
import sys

from shared.errors import DeepinferError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16 | float64")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: CPUs available)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt (in-process engine)")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--url", default=None, help="send to a running cluster (nats://...) instead of in-process")
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
    up.add_argument("--demo", action="store_true", help="send one demo chat request once up")
    up.add_argument("--exit-after-demo", action="store_true")

    serve = sub.add_parser("serve", help="run one service in the foreground (flags after it go to the service)")
    serve.add_argument("service", choices=["router", "prefill", "decode"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra and args.command != "serve":
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from services.cli_generate import run_demo, run_generate
    from services.cli_up import run_remote_generate, run_serve, run_up

    try:
        if args.command == "generate":
            return run_remote_generate(args) if args.url else run_generate(args)
        if args.command == "up":
            return run_up(args)
        if args.command == "serve":
            return run_serve(args, extra)
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
