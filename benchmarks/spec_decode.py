"""Speculative decoding vs plain decoding, side by side on the same prompts (SmolLM2-135M fp32, greedy).

Runs, each on a fresh in-process engine:
- single stream: every prompt alone, ``--new-tokens`` tokens (EOS honoured), from ``engine_prompts.json`` and a
  code-edit set (the prompt holds the code the answer rewrites) — plain, then each drafter;
- ``--concurrent`` streams at once (default 64): plain vs the first drafter (speculation turns itself down above
  ``max_batch`` running sequences, so the ratio should stay near 1);
- fixed k=5 vs the confidence head: drafted (verified) and accepted tokens per proposal, tokens/s.
Prints tokens/s, the ratio against plain, acceptance figures, and whether the greedy tokens equal plain
decoding's (they must, up to float ties).

Single-stream prompts come from the ``test`` side of the prompt split (``spec_acceptance_data.split_of``) by
default: the shipped head was fitted on the ``train`` side, so these figures are out of sample (``--split all``:
the first prompts of the whole pool, as before the split existed; some of them trained the head).

    python -m benchmarks.spec_decode [--prompts 3] [--new-tokens 128] [--drafters prompt_lookup,self:15]
"""
from __future__ import annotations

import argparse
import json
import logging
import time

from benchmarks.spec_acceptance_data import build_prompts, split_pool
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.engine.speculator import SpecConfig, Speculator
from shared.spec.confidence import FixedK, load_head
from shared.spec.factory import make_drafter, shipped_head


def run(prompts: list[list[int]], new_tokens: int, drafter: str | None, head: str, concurrent: bool,
        max_batch: int = 8, threads: int | None = None) -> tuple[float, list[list[int]], dict]:
    """``(tokens/s, outputs, speculation stats)`` on a fresh engine."""
    engine = LLMEngine.from_path(None, EngineConfig(dtype="float32", device="cpu", num_threads=threads))
    spec = None
    if drafter:
        trimmer = FixedK(5) if head == "fixed" else load_head(shipped_head(drafter), 5)
        spec = Speculator(make_drafter(drafter, engine.model), SpecConfig(k=5, max_batch=max_batch), trimmer)
        engine.set_speculator(spec)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    engine.generate([prompts[0][:32]], SamplingParams(max_tokens=8, temperature=0.0))   # warm-up, untimed
    outputs, tokens, t0 = [], 0, time.perf_counter()
    batches = [prompts] if concurrent else [[p] for p in prompts]
    for batch in batches:
        for out in engine.generate(batch, params):
            outputs.append(out)
            tokens += len(out)
    wall = time.perf_counter() - t0
    return tokens / wall, outputs, spec.stats() if spec else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=3, help="prompts per set (bench and code-edit)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--drafters", default="prompt_lookup", help="comma list: prompt_lookup, self:<N>, a path")
    ap.add_argument("--concurrent", type=int, default=64)
    ap.add_argument("--concurrent-tokens", type=int, default=32)
    ap.add_argument("--split", choices=("test", "train", "all"), default="test",
                    help="side of the prompt split for the single-stream prompts (the head trained on train)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every CPU)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    engine = LLMEngine.from_path(None, EngineConfig(dtype="float32", device="cpu", num_kv_blocks=16))
    if args.split == "all":
        named = build_prompts(engine.tokenizer, args.prompts, args.prompts)
    else:
        side = split_pool(engine.tokenizer, args.split)
        bench = [item for item in side if not item[0].startswith("edit")]
        step = max(1, len(bench) // max(1, args.prompts))
        named = bench[::step][:args.prompts] + [item for item in side if item[0].startswith("edit")][:args.prompts]
    sets = {"bench": [ids for name, ids in named if not name.startswith("edit")],
            "code-edit": [ids for name, ids in named if name.startswith("edit")]}
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    report: dict = {}
    for set_name, prompts in sets.items():
        base, ref, _ = run(prompts, args.new_tokens, None, "", False, threads=args.threads)
        print(f"{set_name}: {len(prompts)} prompts one at a time, {args.new_tokens} new tokens: plain {base:.1f} tok/s")
        for drafter in drafters:
            for head in (("head", "fixed") if shipped_head(drafter) else ("fixed",)):
                tps, out, st = run(prompts, args.new_tokens, drafter, head, False, threads=args.threads)
                same = sum(a == b for a, b in zip(out, ref))
                print(f"  {drafter:<14} {head:<5} {tps:6.1f} tok/s  ratio {tps / base:.2f}x  verified/proposal "
                      f"{st['verified_per_proposal']:.2f}  accepted/proposal {st['accepted_per_proposal']:.2f}  "
                      f"acceptance {st['acceptance_rate']:.2f}  tokens/forward {st['tokens_per_forward']:.2f}  "
                      f"identical outputs {same}/{len(ref)}")
                report[f"{set_name}/{drafter}/{head}"] = {"tok_s": round(tps, 2), "plain_tok_s": round(base, 2),
                                                          "ratio": round(tps / base, 3), **st}
    prompts = [ids for _, ids in build_prompts(engine.tokenizer, args.concurrent, 0)][:args.concurrent]
    base, ref, _ = run(prompts, args.concurrent_tokens, None, "", True, threads=args.threads)
    tps, out, st = run(prompts, args.concurrent_tokens, drafters[0], "head", True, threads=args.threads)
    same = sum(a == b for a, b in zip(out, ref))
    print(f"{len(prompts)} concurrent streams, {args.concurrent_tokens} new tokens: plain {base:.1f} tok/s, "
          f"{drafters[0]} {tps:.1f} tok/s, ratio {tps / base:.2f}x (proposals {st['proposals']}), "
          f"identical outputs {same}/{len(ref)}")
    report["concurrent"] = {"streams": len(prompts), "plain_tok_s": round(base, 2), "tok_s": round(tps, 2),
                            "ratio": round(tps / base, 3), **st}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
