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
    _add_engine_args(gen)
    _add_sampling_args(gen)

    demo = sub.add_parser("demo", help="load the default model and answer one chat request")
    _add_engine_args(demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from services.cli_generate import run_demo, run_generate

    try:
        if args.command == "generate":
            return run_generate(args)
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
