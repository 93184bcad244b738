"""The CLI's one vocabulary: flags that mean the same thing are spelled once, with one default, here.

- ``--nats-url`` names a NATS server wherever one is named (``up`` / ``generate`` / ``status`` / ``bench``: the
  server to use; ``node``: where this host's server listens).
- ``add_cluster_flags``: what ``up`` and ``node`` both start (model, KV budget, tiers, drafts, HTTP), one default
  each. Only the counts of what runs (``--prefill``, ``--decode``, ``--cache-tier``) differ by command: ``up`` is a
  whole cluster, ``node`` runs nothing it is not told to.
- ``--sim-*`` configure simulated workers (``bench --simulate``); ``--admission-ttft`` is the router's admission
  control, ``--ttft-slo`` / ``--tpot-slo`` are measurement thresholds (SLO attainment).
- Drafts: ``--draft local|remote`` (where), ``--draft-services N`` (how many, with remote), ``--drafter SPEC``
  (which: ``shared/spec/factory.py``, default ``DEFAULT_DRAFTER`` everywhere).

Old spellings stay accepted for one release (``deprecated``): they store into the new flag and warn once.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from shared.engine.config import DEFAULT_KV_CACHE_MB
from shared.spec.factory import DEFAULT_DRAFTER

logger = logging.getLogger("deepinfer.cli")

DEFAULT_TRANSPORTS = "cuda_ipc,shm,nixl,tcp,stream"
DEFAULT_TIER_DIR = str(Path.home() / ".cache" / "deepinfer" / "cache-tier")


class _Deprecated(argparse.Action):
    """An old spelling of ``new``: the value goes to the new flag's ``dest``, with a warning on stderr."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        logger.warning("deepinfer: %s is deprecated and goes away in the next release; say %s", option_string,
                       self.new)
        setattr(namespace, self.dest, values)


def deprecated(parser: argparse.ArgumentParser, old: str, new: str, dest: str, **kwargs) -> None:
    """Accept ``old`` as a hidden, warning spelling of ``new`` (stored in ``dest``)."""
    parser.add_argument(old, dest=dest, action=_Deprecated, new=new, help=argparse.SUPPRESS,
                        default=argparse.SUPPRESS, **kwargs)


def add_nats_url(parser: argparse.ArgumentParser, help: str, required: bool = False, default=None) -> None:
    """``--nats-url`` (old spellings ``--nats`` and ``--url``). ``required`` is checked by ``check_required``
    after parsing (argparse's own check would refuse an old spelling)."""
    parser.add_argument("--nats-url", default=default, metavar="nats://HOST:PORT",
                        help=help + (" (required)" if required else ""))
    parser.set_defaults(nats_url_required=required)
    for old in ("--url", "--nats"):
        deprecated(parser, old, "--nats-url", "nats_url")


def check_required(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` when a command that needs a NATS server was given none."""
    if getattr(args, "nats_url_required", False) and not args.nats_url:
        parser.error(f"{args.command}: --nats-url is required")


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """The flags ``up`` and ``node`` share (``ClusterSpec`` fields; one default each)."""
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: the bundled SmolLM2)")
    parser.add_argument("--served-model-name", default="", metavar="NAME",
                        help="the model id clients name (default: from the model file, e.g. SmolLM2-135M-Instruct)")
    parser.add_argument("--chat-template", default="", metavar="FILE",
                        help="a Jinja chat template used instead of the model's (e.g. "
                             "shared/model/templates/chatml_tools.jinja: ChatML with tools)")
    parser.add_argument("--tool-call-parser", default="", choices=["", "hermes", "llama3_json"],
                        help="read tool_choice auto calls from the model's text in this format")
    parser.add_argument("--reasoning-parser", default="", choices=["", "deepseek_r1", "qwen3"],
                        help="return <think>...</think> as the chat message's reasoning_content")
    parser.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                        help="CORS on the HTTP API: * or comma-separated origins (default: none)")
    parser.add_argument("--dtype", default="auto",
                        help="weights, activations and KV: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16")
    parser.add_argument("--kv-cache-mb", type=int, default=DEFAULT_KV_CACHE_MB,
                        help=f"each engine worker's KV pool (default {DEFAULT_KV_CACHE_MB}, the in-process engine's)")
    parser.add_argument("--swa-kv-context", type=int, default=0, metavar="TOKENS",
                        help="sliding-window models: split each worker's KV budget between full and window pools "
                             "for prompts of this length (default: min(context, 4096); README: SWA-aware KV)")
    parser.add_argument("--rope-scaling", default="", metavar="JSON",
                        help="replace the model's RoPE scaling to extend its context, as Qwen2.5 documents: "
                             "'{\"rope_type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 32768}' "
                             "serves 131,072 tokens (an extension: README, Long contexts)")
    parser.add_argument("--tier-kv-format", default="", choices=["", "fp8", "int8"],
                        help="KV blocks to and from the cache tier compressed: fp8 (e4m3) or int8 with a scale per "
                             "layer row, K/V half and head (default: the model's dtype)")
    parser.add_argument("--scheduling-policy", default="priority", choices=["fcfs", "priority"],
                        help="the engines' waiting order and preemption: fcfs, or priority (a request's "
                             "`priority`, lower first, then arrival; a higher class preempts a lower one's KV)")
    parser.add_argument("--preempt-offer-mib", type=int, default=0,
                        help="> 0: a preempted sequence's KV is copied to the cache tier (at most this many MiB in "
                             "flight per worker) and pulled back before it is readmitted, instead of recomputed")
    parser.add_argument("--transports", default=DEFAULT_TRANSPORTS, help="KV transports workers offer, in preference")
    parser.add_argument("--local-prefill-threshold", type=int, default=64)
    parser.add_argument("--policy", default="predictive",
                        help="placement: round_robin | least_loaded | cache_aware | kv_cost | predictive")
    parser.add_argument("--admission-ttft", type=float, default=0.0, metavar="S",
                        help="admission control: reject (overloaded) requests whose predicted TTFT exceeds S seconds")
    deprecated(parser, "--ttft-slo", "--admission-ttft", "admission_ttft", type=float)
    parser.add_argument("--cache-tier-dir", default=DEFAULT_TIER_DIR,
                        help="where the tiers keep their SSD files (default ~/.cache/deepinfer/cache-tier; kept)")
    parser.add_argument("--tier-dram-mb", type=int, default=1024, metavar="MB", help="each cache tier's DRAM budget")
    parser.add_argument("--no-tier-reserve", action="store_true",
                        help="do not fault in the tiers' DRAM budget at start (default: reserved, so filling it never "
                             "page-faults while serving; services/cache_tier/store/dram_reserve.py)")
    parser.add_argument("--draft", default="", metavar="local|remote",
                        help="speculative decoding: 'local' (a drafter inside each decode worker) or 'remote' "
                             "(draft services; a number N is the old spelling of --draft remote --draft-services N)")
    parser.add_argument("--draft-services", type=int, default=1, metavar="N",
                        help="with --draft remote: draft services to start here (default 1)")
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER,
                        help="prompt_lookup | self:<layers> (the model's first layers) | mtp (a DeepSeek V3 "
                             "checkpoint's own next-n layer; --draft local) | a smaller model's path")
    parser.add_argument("--http-host", default="127.0.0.1",
                        help="the router's OpenAI-compatible API address (0.0.0.0: reachable from other hosts)")
    parser.add_argument("--http-port", type=int, default=8000, help="its port (0 = any free port, -1 = no HTTP)")


def cluster_flag_values(args: argparse.Namespace) -> dict:
    """The ``ClusterSpec`` fields ``add_cluster_flags`` sets the same way for ``up`` and ``node``."""
    return dict(served_model_name=args.served_model_name, chat_template=args.chat_template,
                tool_call_parser=args.tool_call_parser, allowed_origins=args.allowed_origins,
                reasoning_parser=args.reasoning_parser, dtype=args.dtype, kv_cache_mb=args.kv_cache_mb,
                swa_kv_context=args.swa_kv_context, rope_scaling=args.rope_scaling,
                tier_kv_format=args.tier_kv_format,
                scheduling_policy=args.scheduling_policy, preempt_offer_mib=args.preempt_offer_mib,
                local_prefill_threshold=args.local_prefill_threshold, policy=args.policy,
                ttft_slo_s=args.admission_ttft, cache_tier=args.cache_tier, cache_tier_dir=args.cache_tier_dir,
                cache_tier_dram_mb=args.tier_dram_mb, cache_tier_reserve_dram=not args.no_tier_reserve,
                drafter=args.drafter, transports=args.transports)
