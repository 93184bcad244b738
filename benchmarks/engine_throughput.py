"""Engine throughput: deepinfer's engine vs HF transformers ``generate`` on the same 64 prompts.

Same model (SmolLM2-135M-Instruct, dequantised to fp32), same dtype, same thread count, greedy, 64 new
tokens, EOS ignored. Prints output tokens/s for both, their ratio, and whether the greedy tokens agree.
The prompt set is the one behind ``../shared/PEERS.md`` (vLLM-CPU ≈85 tok/s, HF batch 16 ≈17 tok/s here).

    python benchmarks/engine_throughput.py                 # full set, HF batch 16
    python benchmarks/engine_throughput.py --limit 16      # quicker
    python benchmarks/engine_throughput.py --profile       # cProfile of deepinfer's Python
    python benchmarks/engine_throughput.py --skip-hf --breakdown --prompt-set shared-prefix --block-size 32
        # wall time by category (linear, attention, sampling, scheduling, Python), the variant with a shared
        # 1,002-token system block, another KV block size; --expect-ids FILE checks greedy agreement with
        # another engine's outputs (benchmarks/vllm_compare.py writes vLLM's)
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import logging
import os
import pstats
import time
from pathlib import Path

import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.model.loader import load_model_files

PROMPTS = Path(__file__).parent / "data" / "engine_prompts.json"
SYSTEM_TOKENS = 1002  # the shared-prefix variant: one system block of this many tokens before every prompt
log = logging.getLogger("bench")


def load_prompt_set(name: str, limit: int) -> list[list[int]]:
    """``distinct``: the set's prompts (token ids, as vLLM and HF consumed them). ``shared-prefix``: the same
    prompts behind one ``SYSTEM_TOKENS``-token block (the set's other prompts' tokens, fixed), so every prompt
    after the first can reuse the block from the prefix cache."""
    data = json.loads(PROMPTS.read_text())["prompts"]
    prompts = [p["token_ids"] for p in data[:limit]]
    if name == "distinct":
        return prompts
    pool = [t for p in reversed(data) for t in p["token_ids"]]
    system = pool[:SYSTEM_TOKENS]
    return [system + p for p in prompts]


def run_deepinfer(config, weights, tokenizer, prompts, new_tokens, engine_cfg, profile: bool, breakdown: bool = False):
    from benchmarks import engine_profile
    from shared.model.llama import LlamaModel

    model = LlamaModel(config, weights, getattr(torch, engine_cfg.dtype), torch.device("cpu"))
    engine = LLMEngine(model, engine_cfg, tokenizer)
    # exactly new_tokens, EOS never sampled: what HF's min_new_tokens does below (ignore_eos alone would let EOS
    # be sampled and carry on after it, a different sequence wherever EOS is the argmax)
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    with engine_profile.instrument(engine) if breakdown else contextlib.nullcontext() as timing:
        t0 = time.perf_counter()
        outputs = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
    if profiler:
        profiler.disable()
    if timing is not None:
        print(engine_profile.format_report(timing.report(wall), wall))
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    return outputs, wall, engine.block_manager.num_hit_tokens


def run_hf(config, weights, prompts, new_tokens, batch_size):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                         intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                         num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                         head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
                         max_position_embeddings=config.max_position_embeddings,
                         tie_word_embeddings=config.tie_word_embeddings, pad_token_id=0)
    model = LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    outputs, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        outputs += gen[:, width:].tolist()
    return outputs, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--max-batched-tokens", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-set", default="distinct", choices=["distinct", "shared-prefix"])
    ap.add_argument("--breakdown", action="store_true", help="wall time by category (benchmarks/engine_profile.py)")
    ap.add_argument("--expect-ids", type=Path, default=None,
                    help="JSON list of another engine's output ids: report greedy agreement")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    data = json.loads(PROMPTS.read_text())
    config, weights, tokenizer = load_model_files(None)
    # The set's own token ids (what vLLM and HF consumed); our tokenizer splits digits like SmolLM2's
    # tokenizer.json, while the set was tokenized by transformers' GGUF conversion, which does not.
    prompts = load_prompt_set(args.prompt_set, args.limit)
    retokenized = sum(tokenizer.encode(p["text"]) != p["token_ids"] for p in data["prompts"][:args.limit])
    log.info("%d prompts, %d prompt tokens (%d tokenize differently with our tokenizer), %d threads",
             len(prompts), sum(map(len, prompts)), retokenized, threads)
    engine_cfg = EngineConfig(max_num_batched_tokens=args.max_batched_tokens, dtype=args.dtype, device="cpu",
                              block_size=args.block_size)
    ours, wall, hits = run_deepinfer(config, weights, tokenizer, prompts, args.new_tokens, engine_cfg,
                                     args.profile, args.breakdown)
    n_out = sum(map(len, ours))
    ours_tps = n_out / wall
    print(f"deepinfer engine : {n_out} tokens in {wall:7.1f} s = {ours_tps:6.1f} tok/s "
          f"(prefix-cache hit tokens {hits}; {args.prompt_set}, block {args.block_size}, "
          f"batched tokens {args.max_batched_tokens}, {args.dtype})")
    if args.expect_ids is not None:
        theirs = json.loads(args.expect_ids.read_text())
        same = sum(a == b for a, b in zip(ours, theirs))
        print(f"greedy agreement with {args.expect_ids.name}: {same}/{len(ours)} identical sequences")
    if args.skip_hf:
        return
    theirs, hf_wall = run_hf(config, weights, prompts, args.new_tokens, args.hf_batch)
    hf_tps = sum(map(len, theirs)) / hf_wall
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f"HF generate b={args.hf_batch:<3d}: {sum(map(len, theirs))} tokens in {hf_wall:7.1f} s = {hf_tps:6.1f} tok/s")
    print(f"ratio deepinfer / HF = {ours_tps / hf_tps:.2f}x; identical greedy sequences: {same}/{len(ours)}")
    differ = [(i, next(j for j, (x, y) in enumerate(zip(a, b)) if x != y))
              for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    if differ:
        print("differing (prompt, first differing position):", differ)


if __name__ == "__main__":
    main()
