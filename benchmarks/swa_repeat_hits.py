"""Repeat hits of a sliding-window model's own prefix cache, by how the KV budget is split (issue 37).

Gemma 3 270M (the packaged GGUF, fp32 on CPU, ``--kv-cache-mb`` of KV like a worker's default), no cache tier:
``--prompts`` prompts of 300 to 3,000 tokens (real text: the bench prompt set's sources, tokenized by Gemma, one
slice each, no shared prefix), each generated once, then the same prompts again in the same order. For each split
of the budget between the full-attention and the window pool it prints the pools, every repeat's cached tokens,
the repeat pass's hit rate (cached / prompt tokens) and its wall time, side by side:

- ``context`` split: the rule before this change, pools sized for sequences of ``max_model_len`` (32K) tokens;
- ``default`` split: ``hybrid_kv.SWA_KV_CONTEXT`` (4,096-token prompts).

Both run with the same engine code otherwise (released window blocks recycled first: ``BlockManager``). The
repeats' greedy tokens must equal the first pass's (a miss recomputes, a hit reuses: both exact).

    python benchmarks/swa_repeat_hits.py                 # about 3 min on 2 CPU cores
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.engine.config import DEFAULT_KV_CACHE_MB, EngineConfig
from shared.engine.hybrid_kv import SWA_KV_CONTEXT
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams

logger = logging.getLogger("swa_repeat_hits")
PROMPTS = Path(__file__).parent / "data" / "engine_prompts.json"


def prompt_ids(engine: LLMEngine, count: int) -> list[list[int]]:
    """``count`` token-id prompts of 300 .. 3,000 tokens, each its own slice of the bench set's text."""
    texts = [p["text"] for p in json.loads(PROMPTS.read_text())["prompts"]]
    ids = engine.tokenizer.encode("\n\n".join(texts * 4))
    lengths = [300 + (2700 * i) // max(1, count - 1) for i in range(count)]
    out, at = [], 0
    for n in lengths:
        out.append([ids[0], *ids[at + 1:at + n]])
        at += n
    return out


def run(path: str, context: int | None, prompts: list[list[int]], kv_mb: int, new_tokens: int) -> dict:
    eng = LLMEngine.from_path(path, EngineConfig(kv_cache_bytes=kv_mb << 20, swa_kv_context=context))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    first = [eng.generate([p], params)[0] for p in prompts]
    cached, again = [], []
    t0 = time.perf_counter()
    for p in prompts:
        rid, got, last = eng.add_request(p, params), [], None
        while eng.has_unfinished():
            for out in eng.step():
                got += out.new_token_ids
                last = out
        again.append(got)
        cached.append(last.num_cached_tokens)
    wall = time.perf_counter() - t0
    if again != first:
        raise SystemExit(f"split {context}: repeated greedy tokens differ from the first pass")
    return {"pools": eng.kv_pools(), "cached": cached, "wall_s": wall,
            "hit_rate": sum(cached) / sum(len(p) for p in prompts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--kv-cache-mb", type=int, default=DEFAULT_KV_CACHE_MB)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    probe = LLMEngine.from_path(args.model, EngineConfig(num_kv_blocks=64, swa_kv=False))
    prompts, context = prompt_ids(probe, args.prompts), probe.max_model_len
    del probe
    logger.info("%s, %d prompts of %s tokens, %d MiB KV, %d new tokens each", args.model, len(prompts),
                [len(p) for p in prompts], args.kv_cache_mb, args.new_tokens)
    results = {}
    for name, ctx in ((f"context ({context})", context), (f"default ({SWA_KV_CONTEXT})", None)):
        res = results[name] = run(args.model, ctx, prompts, args.kv_cache_mb, args.new_tokens)
        pools = ", ".join(f"{p['name']} {p['blocks']} blocks ({p['blocks'] * p['block_bytes'] / 2**20:.0f} MiB)"
                          for p in res["pools"])
        logger.info("split for %-16s pools: %s", name, pools)
        logger.info("  repeats' cached tokens %s", res["cached"])
        logger.info("  repeat pass: hit rate %.1f%%, %.1f s", 100 * res["hit_rate"], res["wall_s"])
    before, after = results.values()
    logger.info("default vs context split: hit rate %.1f%% vs %.1f%%, repeat pass %.2fx faster",
                100 * after["hit_rate"], 100 * before["hit_rate"], before["wall_s"] / after["wall_s"])


if __name__ == "__main__":
    main()
