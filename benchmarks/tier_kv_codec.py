"""Compressed tier KV (``--tier-kv-format fp8 | int8``, issue 33 item 3): bytes and what a hit from compressed
blocks does to the output, on the default SmolLM2-135M (fp32, CPU).

For every prompt of the bench set (``benchmarks/data/engine_prompts.json``, 64 prompts) and for long contexts made
of them (``--long`` contexts of ``--long-tokens`` tokens each): the reference is a greedy run of ``--tokens``
tokens with logprobs; the compressed run prefills the prompt, round-trips every cached block of its prefix through
the codec in the device cache (exactly the blocks a tier hit would import), then serves the prompt again as a
prefix hit. Printed per format: bytes per token and tier tokens per GiB beside the model's dtype, the share of
runs whose greedy tokens are all equal to the reference, the mean share of tokens before the first divergence,
and the largest |logprob| difference of the first generated token.

    python benchmarks/tier_kv_codec.py          # about 3 min on 2 CPU cores
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.kv.kv_codec import FORMATS, KVCodec
from shared.sampling import SamplingParams
from tests.integration.services_harness import round_trip_cached

logger = logging.getLogger("tier_kv_codec")
PROMPTS = Path(__file__).parent / "data" / "engine_prompts.json"


def prompts(long: int, long_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    bench = [p["token_ids"] for p in json.loads(PROMPTS.read_text())["prompts"]]
    joined = [t for p in bench for t in p]
    contexts = [joined[i * long_tokens // 2:i * long_tokens // 2 + long_tokens] for i in range(long)]
    return bench, [c for c in contexts if len(c) == long_tokens]


def greedy(eng: LLMEngine, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """Greedy tokens and the first token's logprob (the engine's own, exact)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    rid = eng.add_request(prompt, params)
    out, first = [], None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                out += o.new_token_ids
                if first is None and o.logprobs is not None:
                    first = o.logprobs.token_logprobs[0]
    return out, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--long", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    config = EngineConfig(num_threads=args.threads, max_num_batched_tokens=2048)
    ref_engine = LLMEngine.from_path(None, config)
    bench, long = prompts(args.long, args.long_tokens)
    sets = {"bench": bench, f"{args.long_tokens}-token": long}
    refs = {name: [greedy(ref_engine, p, args.tokens) for p in ps] for name, ps in sets.items()}
    block_shape = list(ref_engine.runner.kv_cache.shape[1:])
    bs = ref_engine.config.block_size
    plain = ref_engine.kv_port.block_bytes / bs
    logger.info("SmolLM2-135M fp32: %.0f B of KV per token, %.0f tier tokens per GiB", plain, 2 ** 30 / plain)
    for name in FORMATS:
        codec = KVCodec(name)
        per_token = block_shape[0] * codec.row_bytes(block_shape) / bs
        logger.info("%s: %.0f B per token (%.2fx of fp32, %.2fx of bf16), %.0f tier tokens per GiB", name, per_token,
                    per_token / plain, per_token / (plain / 2), 2 ** 30 / per_token)
        eng = LLMEngine(ref_engine.model, config, ref_engine.tokenizer)
        for set_name, ps in sets.items():
            equal, prefix, delta = 0, 0.0, 0.0
            for prompt, (ref_tokens, ref_lp) in zip(ps, refs[set_name]):
                eng.block_manager.reset_prefix_cache()   # nothing of an earlier prompt (or format) is reused
                eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
                round_trip_cached(eng, codec)
                tokens, lp = greedy(eng, prompt, args.tokens)
                same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
                equal += same == len(tokens)
                prefix += same / len(tokens)
                delta = max(delta, abs(lp - ref_lp))
            logger.info("  %-12s %2d prompts: all %d tokens equal in %d (%.0f%%), %.1f%% of tokens before the first "
                        "divergence, first-token |logprob delta| <= %.4f", set_name, len(ps), args.tokens, equal,
                        100 * equal / len(ps), 100 * prefix / len(ps), delta)


if __name__ == "__main__":
    main()
